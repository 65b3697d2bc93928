"""Built-in quantization methods (``--quantization``)."""
