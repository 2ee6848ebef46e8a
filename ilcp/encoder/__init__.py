"""encoder"""
