"""Integrations of kda_ops into other libraries. Each submodule imports its library only when imported
itself: ``import kda_ops`` never imports transformers (or FLA)."""
