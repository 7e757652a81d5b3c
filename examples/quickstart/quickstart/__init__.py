"""fedcomp quickstart: a cross-silo Flower app whose uploads are compressed."""
