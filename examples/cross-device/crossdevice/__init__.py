"""fedcomp cross-device example: few nodes per round, first contact from the seeded model."""
