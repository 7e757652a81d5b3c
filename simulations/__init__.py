"""The project's Flower apps, tasks, experiments, benchmarks and deployment helpers (import `fedcomp.simulations`)."""
