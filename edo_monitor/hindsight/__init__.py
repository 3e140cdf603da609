"""Looking back over a recorded run: explain (shortfall and remedies per incident), replay
(recorded samples through the real Policy), the job view. Reads only the history database."""
