"""What a completion request does below the HTTP layer: prompt, safety, placement, generations, formatting."""
