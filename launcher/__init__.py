"""The driver side of hvd_edl: ``hvd-edl-run``'s CLI, coordinator, host discovery and spawning."""
