"""What follows a failed, drained or hung attempt: restart decisions, drains, the advance of a job."""
