"""atlas"""
