"""HTTP routes, one module per resource. Thin: validate, call a service or store, render."""
