"""Simulation of a FlexMARL job at cluster scale: cost models, hardware profiles, planning."""
