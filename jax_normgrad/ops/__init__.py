"""The public functions, one module per op family: argument checks, reshape to the canonical layout, bind."""
