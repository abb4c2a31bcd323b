"""description"""
