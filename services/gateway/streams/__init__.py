"""SSE streams: replay logs for resumes, the SSE response, and relaying logs and cancels across replicas."""
