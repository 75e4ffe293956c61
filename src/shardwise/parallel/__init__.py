"""One module per parallel technique, each an `apply_*` taking the mesh explicitly; `compose` fixes their order."""
