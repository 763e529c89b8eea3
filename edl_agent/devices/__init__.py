"""Accelerator discovery: vendor backends that read a host root and return a vendor-neutral model."""
