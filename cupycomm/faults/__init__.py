"""What happens when a rank goes wrong."""
