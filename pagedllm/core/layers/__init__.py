"""Building blocks shared by the model implementations."""
