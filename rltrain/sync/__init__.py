"""Weight sync from the trainer to the engines."""
