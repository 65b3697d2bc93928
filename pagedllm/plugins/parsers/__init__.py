"""Built-in tool-call and reasoning parsers."""
