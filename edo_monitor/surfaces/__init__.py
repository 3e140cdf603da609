"""What the user types: the edo-monitor CLI, the daemon, the examples' argument parsing.
Reads the store and hindsight; nothing below imports these."""
