"""fedcomp deployment example: the quickstart app on SuperNodes over TLS with node authentication."""
