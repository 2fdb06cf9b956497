"""Drives `snug serve`'s web chat page in a real headless browser (Debian's
chromium through chromedriver, with Selenium): loads the page, sends a
message and watches the answer stream in, stops a long answer part way,
reloads and finds both conversations in the list, opens the first one
again. Prints one JSON summary; exits non-zero on the first failure.

    python3 scripts/browser-client-check.py http://127.0.0.1:8080
"""

import json
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def wait(what, cond, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        try:
            v = cond()
        except (StaleElementReferenceException, NoSuchElementException):
            # The page redrew (or has not yet drawn) what the condition
            # reads; look again on the next poll.
            v = None
        if v:
            return v
        time.sleep(0.05)
    check(False, f"timed out waiting for {what}")


def main():
    base = sys.argv[1]
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    summary = {}
    try:
        driver.get(base + "/")
        check(driver.title == "snug", f"title {driver.title!r}")
        wait("the model's name", lambda: driver.find_element(By.ID, "g-model").text not in ("", "?"))
        summary["model"] = driver.find_element(By.ID, "g-model").text

        def answers():
            return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")

        # A message; the answer grows in several steps as tokens stream.
        driver.find_element(By.CSS_SELECTOR, "details summary").click()
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        box = driver.find_element(By.ID, "input")
        box.send_keys("Name three colours of the rainbow.")
        box.send_keys(Keys.ENTER)
        seen = set()
        end = time.time() + 120
        while time.time() < end:
            a = answers()
            if a:
                seen.add(a[-1].find_element(By.CLASS_NAME, "text").text)
                if a[-1].get_attribute("data-finish"):
                    break
            time.sleep(0.005)
        first = answers()[-1]
        text = first.find_element(By.CLASS_NAME, "text").text
        check(first.get_attribute("data-finish") in ("stop", "length"), f"finish {first.get_attribute('data-finish')!r}")
        check(len(text) > 0, "an answer")
        check(len(seen) >= 3, f"the answer streamed in steps (saw {len(seen)} states)")
        summary["first_answer"] = text
        summary["stream_states"] = len(seen)

        # A long answer, stopped part way: it ends early and stays.
        wait("the send button", lambda: driver.find_element(By.ID, "send").is_enabled())
        driver.find_element(By.ID, "new").click()
        driver.find_element(By.ID, "max_tokens").clear()
        driver.find_element(By.ID, "max_tokens").send_keys("2000")
        box.send_keys("Write a long story about a dragon who learns to fly, with many chapters.")
        box.send_keys(Keys.ENTER)
        wait("tokens of the long answer", lambda: len(answers()) == 1 and len(answers()[0].text) > 20)
        check(driver.find_element(By.ID, "stop").is_enabled(), "the stop button is live while the answer streams")
        driver.find_element(By.ID, "stop").click()
        wait("the answer's end", lambda: answers()[0].get_attribute("data-finish"), timeout=30)
        finish = answers()[0].get_attribute("data-finish")
        check(finish == "stopped", f"the long answer ended {finish!r}, not stopped: {answers()[0].text[-200:]!r}")
        stopped = answers()[0]
        kept = stopped.find_element(By.CLASS_NAME, "text").text
        time.sleep(1)
        check(stopped.find_element(By.CLASS_NAME, "text").text == kept, "nothing arrives after the stop")
        summary["stopped_chars"] = len(kept)

        # Reload: both conversations are listed, the newest open.
        time.sleep(0.5)
        driver.refresh()
        # The list and the open conversation may be redrawn while they are
        # read, so each wait reads texts, not elements kept across polls.
        def listed():
            lis = driver.find_elements(By.CSS_SELECTOR, "#chats li")
            return len(lis) >= 2 and [li.text.replace("\nx", "").strip() for li in lis]

        titles = wait("the conversation list", listed)
        check(any(t.startswith("Write a long story") for t in titles), f"titles {titles}")
        check(any(t.startswith("Name three colours") for t in titles), f"titles {titles}")
        reopened = wait("the open conversation", lambda: answers() and [answers()[0].find_element(By.CLASS_NAME, "text").text])
        check(reopened[0] == kept, "the stopped answer came back as kept")

        # Open the first conversation again: its answer is the one streamed.
        def open_first():
            for li in driver.find_elements(By.CSS_SELECTOR, "#chats li"):
                if li.text.startswith("Name three colours"):
                    li.find_element(By.TAG_NAME, "a").click()
                    return True
            return False

        wait("the first conversation's entry", open_first)
        wait("the first conversation", lambda: answers() and answers()[0].find_element(By.CLASS_NAME, "text").text == text)
        summary["titles"] = titles
        wait("the gauges", lambda: driver.find_element(By.ID, "g-kv").text not in ("", "-"), timeout=10)
        summary["kv"] = driver.find_element(By.ID, "g-kv").text
        summary["memory"] = driver.find_element(By.ID, "g-mem").text
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"] if hasattr(driver, "get_log") else []
        check(not errors, f"console errors: {errors}")
    finally:
        driver.quit()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
