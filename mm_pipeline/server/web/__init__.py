"""The upload page served at ``GET /``: its static files (package data) and their routes (routes.py)."""
