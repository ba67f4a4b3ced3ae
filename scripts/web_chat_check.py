#!/usr/bin/env python3
"""Drives Strata's chat page in a real headless Chromium (Debian's chromium + chromedriver, through
selenium): loads `/`, waits for the model name, sends a message, waits for the streamed answer to
finish, checks it is on the page, and saves a screenshot.

Usage: python3 scripts/web_chat_check.py http://127.0.0.1:8080 OUT.png
Needs: apt-get install chromium chromium-driver; pip install selenium
"""
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

url, shot = sys.argv[1], sys.argv[2]
opts = webdriver.ChromeOptions()
opts.binary_location = "/usr/bin/chromium"
for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--window-size=1100,800", f"--user-data-dir={tempfile.mkdtemp()}"]:
    opts.add_argument(flag)
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
try:
    driver.get(url + "/")
    wait = WebDriverWait(driver, 180)
    wait.until(lambda d: d.find_element(By.ID, "model").text.startswith("model: ") and "…" not in d.find_element(By.ID, "model").text)
    model = driver.find_element(By.ID, "model").text
    box = driver.find_element(By.ID, "input")
    box.send_keys("What is the capital of France? Answer in one sentence.")
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state='done']")
               or d.find_elements(By.CSS_SELECTOR, ".msg.error"))
    errors = driver.find_elements(By.CSS_SELECTOR, ".msg.error")
    assert not errors, errors[0].text
    answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant").text
    user = driver.find_element(By.CSS_SELECTOR, ".msg.user").text
    assert user == "What is the capital of France? Answer in one sentence.", user
    assert answer.strip(), "empty answer"
    time.sleep(0.2)
    driver.save_screenshot(shot)
    print(f"{model} | answer: {answer[:120]!r} | speed: {driver.find_element(By.ID, 'speed').text}")
    print("web chat check: ok")
finally:
    driver.quit()
