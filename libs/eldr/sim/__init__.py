"""Discrete-event simulation of a PD cluster's decode side (used by `eldr bench`)."""
