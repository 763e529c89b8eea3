"""Device health: what makes a device unusable, found by watching and polling."""
