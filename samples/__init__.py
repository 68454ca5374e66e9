"""Sample data for mmserve: the synthetic caption task generator and a few committed media files."""
