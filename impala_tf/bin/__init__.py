"""absl-flag binaries: impala-train (and, later, evaluate and export)."""
