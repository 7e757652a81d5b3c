"""Federated simulations on fedcomp: the default task, runners and results."""
