"""Built-in guided-decoding backends (``--guided-decoding-backend``)."""
