"""Activations: what a decoder layer keeps for backward and the transients around it, per family (recipes), with
peft's adapters, a quantised base and the loss; the profile of a resolved set-up (profile)."""
