// Package childproc is the child-process contract of bench/common.py, shared by
// the benchmark's Go programs: JSON lines on stdout, one command per line on
// stdin, and an end by itself at a deadline or when the parent is gone.
package childproc

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
)

var outputLock sync.Mutex

// Emit writes one JSON line to stdout.
func Emit(payload map[string]interface{}) {
	line, err := json.Marshal(payload)
	if err != nil {
		line, _ = json.Marshal(map[string]interface{}{"error": err.Error()})
	}
	outputLock.Lock()
	os.Stdout.Write(append(line, '\n'))
	outputLock.Unlock()
}

// StopByItself ends the process at its deadline or when its parent is gone.
func StopByItself(deadline time.Duration) {
	time.AfterFunc(deadline, func() {
		fmt.Fprintf(os.Stderr, "bench child %d: deadline of %v passed, exiting\n", os.Getpid(), deadline)
		os.Exit(3)
	})
	parent := os.Getppid()
	go func() {
		for range time.Tick(500 * time.Millisecond) {
			if os.Getppid() != parent {
				os.Exit(3)
			}
		}
	}()
	var limit syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &limit) == nil && limit.Cur < limit.Max {
		limit.Cur = limit.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &limit)
	}
}

// AnswerCommands answers each JSON command on stdin with handle's result, until stdin ends.
func AnswerCommands(handle func(map[string]interface{}) map[string]interface{}) {
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<16), 1<<20)
	for scanner.Scan() {
		line := scanner.Bytes()
		if len(line) == 0 {
			continue
		}
		var command map[string]interface{}
		if err := json.Unmarshal(line, &command); err != nil {
			Emit(map[string]interface{}{"error": err.Error()})
			continue
		}
		Emit(handle(command))
	}
}
