"""IAM service: tokens, nested projects with delegated quotas, quota reservations."""
