"""ELDR service processes (package `eldr_services`): thin shells over `eldr` libraries."""
