"""The runtime floor: the only floor that runs torch's runtime machinery. The real training step (step, build,
distributed, optimizers, losses, offload), CUDA's behaviour emulated on the CPU keys (cuda, quant_kernels, patches),
the ledger of its allocations (ledger, replay), and the engines that run it: trace (fake tensors) and measure (a
real device)."""
