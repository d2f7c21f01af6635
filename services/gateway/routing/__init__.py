"""Where a request goes: the scheduler client, its fallback view of the workers, and the gateway's own converters."""
