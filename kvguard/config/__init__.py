"""kvguard's configuration: the TOML schema, its loading and validation, model files."""
