"""Cluster: launcher (one process per device), router (replay + dispatch), KV connector."""
