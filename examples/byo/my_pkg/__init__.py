"""An example user package for meshrun's bring-your-own-model runs (see examples/byo/README.md)."""
