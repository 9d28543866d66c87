"""The `dsec` command-line tool and the local-cluster launcher."""
