"""The model floor: a model's real structure built on the meta device (anatomy), its family's row, its trained
form under peft, the sharding geometry of a layout, the bundled catalog, and the set-up resolved against it."""
