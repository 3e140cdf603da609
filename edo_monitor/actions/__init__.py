"""edo-monitor subpackage."""
