"""The dashboard (edo-tui): Textual screens over the history, read in workers and drawn on the UI
thread. Takes a database; hands nothing on (it never talks to a running agent)."""
