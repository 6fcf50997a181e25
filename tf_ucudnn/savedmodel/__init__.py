"""SavedModel conversion."""
