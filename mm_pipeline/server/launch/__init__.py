"""Running the app: in a thread of this process (tests, jobs) or as an `mmserve serve` subprocess."""
