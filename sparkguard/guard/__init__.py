"""The memory guard: its poll loop, the escalation it shares with the engine supervisor, start-up."""
