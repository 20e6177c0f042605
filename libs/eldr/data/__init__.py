"""Package data (deployments) and loaders for data files from outside the project."""
