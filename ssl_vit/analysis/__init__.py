"""Inspecting trained models: plots and maps written as PNGs."""
