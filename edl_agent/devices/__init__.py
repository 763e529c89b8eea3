"""Accelerator discovery: vendor backends read a host root and return a vendor-neutral model."""
