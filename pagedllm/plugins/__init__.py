"""pagedllm's built-in plugins. Each subpackage is registered through an entry point in
``pyproject.toml``, exactly as a third-party plugin package would be."""
