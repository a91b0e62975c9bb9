"""Integrations of flashdecode with other libraries (transformers). Nothing in the core imports this package."""
