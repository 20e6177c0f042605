"""Package data (cost profiles) and loaders for data files from outside the project."""
