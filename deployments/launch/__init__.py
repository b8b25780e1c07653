"""Starting the service: the application's arguments, the launcher, HAProxy, Ray's security, the CLI."""
