"""The restarter: the fault intake, fault-tolerance policies, their pure decisions and status."""
